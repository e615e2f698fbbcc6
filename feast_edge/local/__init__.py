"""Local co-training on the device (SPEC §7): the recipe, batches and augmentation, mixed precision, one client update."""
