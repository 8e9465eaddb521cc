"""Checkpoints: saving and restoring what a resumed run needs, their on-disk form and verification, which ones exist,
the settings a resume must match, and saves the disk refused."""
