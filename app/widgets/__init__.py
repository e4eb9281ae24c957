"""Widgets of the chat app."""
