"""Offline jobs that make artifacts under var/ from data kept in the repository (never imported by a
stage, never run at serving time): the LoRA adapters the tests and the demo register
(``python -m training.adapters``, what ``make adapters`` runs). They live apart from services/
because no stage serves them and no image ships them; like ``make model`` their output is a cache
that a second run finds and keeps."""
