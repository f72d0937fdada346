"""What a generation asks for and what one row holds."""
