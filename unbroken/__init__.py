"""The ``unbroken`` command line."""
