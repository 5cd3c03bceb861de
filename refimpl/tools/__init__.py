"""The tools around the teaching core."""
