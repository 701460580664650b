"""Pictures of a model and its run: loss curves, attention as PNG figures and as an HTML page.
They take plain numbers (texts, numpy arrays) and import neither torch nor the project."""
