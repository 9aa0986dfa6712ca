"""Peer engines for `pagedserve bench offline`, each in its own virtualenv (see README.md)."""
