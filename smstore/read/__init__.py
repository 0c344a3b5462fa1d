"""Reading blobs and datasets in a process: open, datasets, views, SharedList."""
