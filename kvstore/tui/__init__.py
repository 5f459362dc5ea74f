"""The Textual dashboard: a client of the stats block and the status records only.

``app.py`` holds the App, ``source.py`` the data sources (live shared memory,
or canned statistics for tests and demos), ``widgets/`` one widget per module,
``dashboard.tcss`` the styles.
"""
