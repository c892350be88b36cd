"""Image updates: the updater's command line (installer.py, RAUC's)."""
