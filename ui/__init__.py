"""The app's pages, one module each; ``app.py`` only wires them together.

A page reads widgets, calls the workbench library, and draws what it returns.
"""
