"""dbo package."""
