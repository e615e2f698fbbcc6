"""A web dashboard for a federation, a simulation or finished runs: the fleet, the round in flight, what was learned, the models.

:class:`DashboardState` holds what the page shows (the server or simulation
thread writes it); :func:`start_dashboard` serves it with Starlette and uvicorn
(the optional ``dashboard`` extra) in a thread; :func:`load_runs` fills a state
from finished run directories for ``feast-edge dashboard``.
"""

from feast_edge.dashboard.app import Dashboard, DashboardError, create_app, parse_bind, start_dashboard
from feast_edge.dashboard.runs import load_runs
from feast_edge.dashboard.state import DashboardState

__all__ = ["Dashboard", "DashboardError", "DashboardState", "create_app", "load_runs", "parse_bind", "start_dashboard"]
