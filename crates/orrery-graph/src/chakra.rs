//! Chakra ET export/import.
