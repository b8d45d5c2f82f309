"""Regeneration: every assistant turn of a conversation dataset answered again by the target itself."""
