"""Trainable draft modules that are more than a few linear maps (the EAGLE-3-class head)."""
