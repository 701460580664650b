"""Pictures of a model and its run: curves.py draws the loss curves (a run's curves.png, plot.py, a
sweep's report); attention_maps.py draws one prompt's attention weights and the per-head summary as
figures, and attention_page.py turns them into one self-contained, interactive HTML page. Everything
here takes plain numbers (token texts, numpy arrays) and imports neither torch nor the rest of the
project, so a picture can be made of weights from anywhere."""
