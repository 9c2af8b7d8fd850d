"""Tools built on the device: profiles (profile.json, Chrome traces), charts, balance advice and
the `python -m ipusim.report` command that prints and compares them."""
