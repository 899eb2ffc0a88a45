"""Small single-purpose parts of a training run: checkpoints, export, metrics, generation eval."""
