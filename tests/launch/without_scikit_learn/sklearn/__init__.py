"""Put first on a job's PYTHONPATH, this stands in for a Python without scikit-learn: importing
it fails as a missing package does."""

raise ModuleNotFoundError("No module named 'sklearn'", name="sklearn")
