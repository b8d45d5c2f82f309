"""Models this project builds itself: the embedded tiny target."""
