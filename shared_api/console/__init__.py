"""The ops console: the admin's operations pages (capacity charts, receipt browser, journal holds) and the hold state on every admin page."""
