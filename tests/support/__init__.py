"""Test helpers shared by every test directory (a package on the pytest pythonpath)."""
