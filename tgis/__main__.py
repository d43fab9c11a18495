"""`python -m tgis ...` is `text-generation-server ...`, for a source tree on PYTHONPATH without the console
scripts (a GPU machine with carried wheels: scripts/gpu_benchmark.sh)."""

from tgis.cli import server_main

if __name__ == "__main__":
    server_main()
