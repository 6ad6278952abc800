//! placeholder (moved here from supervisor/src/drill)
