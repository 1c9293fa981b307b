"""The built-in game oddoneout (clemcore game folder: clemgame.json, master.py, in/)."""
