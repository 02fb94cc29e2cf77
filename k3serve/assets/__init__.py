"""Package data: the shipped trained checkpoint ``tiny-trained/`` (preset ``tiny-trained``, see README)."""
