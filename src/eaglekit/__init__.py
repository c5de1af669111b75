"""eaglekit: train EAGLE-3 draft models end to end, checking ground truth before every long phase."""

__version__ = "0.1.0"
