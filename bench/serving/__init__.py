"""Building blocks of the serving benchmark client (`python -m bench.serve`)."""
