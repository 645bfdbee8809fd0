"""Stage `report`: joined tables, the seeds' claims checked, recommendation, HTML pages."""
