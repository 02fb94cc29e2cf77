"""Package data: the shipped trained checkpoint ``tiny-trained/`` (preset ``tiny-trained``, see README) and its
EAGLE-3 drafters ``tiny-trained-drafter/`` (LK) and ``tiny-trained-drafter-kl/`` (KL baseline, docs/eagle3.md)."""
