"""Sampling: the one refinement loop, its step rules, canvases, and the text-in, text-out ``Sampler``."""
