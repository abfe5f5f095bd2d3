"""Decoded pixels as the bytes a client gets: images (PNG, JPEG, WebP) and a video's files."""
