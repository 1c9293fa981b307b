"""The built-in game wordref (clemcore game folder: clemgame.json, master.py, in/)."""
