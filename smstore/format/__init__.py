"""What a blob, a manifest and a record encoding are: the formats every side reads."""
