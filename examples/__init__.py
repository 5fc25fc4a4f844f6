"""Example applications built on ibpcache (not installed; run from the repository root)."""
