"""`python -m engines.hf_optimum_ort MODEL_DIR [--out DIR]`: export a model's ONNX graphs ahead of time."""

import logging
import sys

from engines.hf_optimum_ort.exporter import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
