"""A new user's unusual inputs (issue 37): ``python -m tests.probe`` runs every case and counts the outcomes."""
