import os
import sys

# Test modules import shared model definitions from each other (e.g. the tutorial network).
sys.path.insert(0, os.path.dirname(__file__))
