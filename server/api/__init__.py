"""The HTTP side: the app, one file per dialect over one generation path, and the output stream."""
