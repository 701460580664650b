"""Pictures of a model and its run that are more than a PNG: attention_page.py turns one prompt's
attention weights (every layer and head) and the per-head summary into one self-contained,
interactive HTML page. Everything here takes plain numbers (token texts, numpy arrays) and imports
neither torch nor the rest of the project, so a picture can be made of weights from anywhere."""
