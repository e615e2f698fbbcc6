"""The run loop shared by simulation and deployment: cohorts, rounds, checkpoints and resume, round logs."""
