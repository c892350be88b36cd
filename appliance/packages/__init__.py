"""Content packages (KVL-700): generated, validated, cached, served and exported."""
