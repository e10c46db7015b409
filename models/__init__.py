"""Bundled model definitions (*.dsl), shipped as package data."""
