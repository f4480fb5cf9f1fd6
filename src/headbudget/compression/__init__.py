"""compression."""
