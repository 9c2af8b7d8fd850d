"""`python -m poptorch_lite run script.py [args ...]`: see poptorch_lite.runner."""
from .runner import main

main()
