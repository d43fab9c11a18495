"""Quality through the server: perplexity and top-1 agreement, teacher-forced (`tgis-bench quality`)."""
