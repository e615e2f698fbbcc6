"""Local co-training on the device (method §7): the recipe, batches and augmentation, mixed precision, one client update."""
