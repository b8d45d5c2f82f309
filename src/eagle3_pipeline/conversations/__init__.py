"""Conversation datasets as users keep them, and their rendering through the target's chat template.

Shared by every stage that reads conversations: the regeneration, the extraction and the
evaluation's held-out prompts.
"""
