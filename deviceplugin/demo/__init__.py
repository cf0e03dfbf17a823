"""`gpu-fraction-plugin demo`: both APIs side by side on one simulated node (`story.py`)."""

from deviceplugin.demo.story import run_demo

__all__ = ["run_demo"]
