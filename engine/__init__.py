"""Everything that generates tokens and measures them."""
