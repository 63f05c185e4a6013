"""Pieces for testing engines against coordd: a real coordd process, a raw rank on the wire."""
