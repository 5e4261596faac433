"""Test stub: see ../../sitecustomize.py."""
