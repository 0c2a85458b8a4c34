"""Code that runs inside cyclebox role containers.

Invariant: nothing here imports :mod:`runner`; this package is copied into the
role images on its own and must stand alone (stdlib, plus ``openai`` where a
role talks to the model gateway).
"""
