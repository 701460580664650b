"""Pictures of a model and its run: loss curves (curves.py), one prompt's attention as PNG
figures (attention_plots.py) and as an interactive HTML page (attention_page.py). All take
plain numbers (texts, numpy arrays) and import neither torch nor the rest of the project: a
picture can be made of weights from anywhere."""
