//! The error type of the pool crate.

/// Everything that can go wrong in the pool crate. Every variant names the argument or the
/// source it is about, the offending value and what is accepted.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// A value that could not be parsed or is out of its accepted range.
    #[error("invalid {what} {value:?} from {source_name}: expected {expected}")]
    InvalidValue {
        /// What was being parsed (e.g. "state dtype").
        what: &'static str,
        /// The offending value as given.
        value: String,
        /// Where it came from (env variable, file, argument name).
        source_name: String,
        /// What is accepted.
        expected: String,
    },
    /// An argument that is inconsistent with the pool or the model.
    #[error("invalid argument {arg}: {msg}")]
    InvalidArgument {
        /// The argument's name.
        arg: &'static str,
        /// Why it is refused.
        msg: String,
    },
    /// A configuration file that is missing, unreadable or malformed.
    #[error("{path}: {msg}")]
    Config {
        /// The file.
        path: String,
        /// What is wrong (names the field).
        msg: String,
    },
    /// No free slot is left.
    #[error("state pool exhausted: all {capacity} slots are in use")]
    Exhausted {
        /// Number of request slots in the pool.
        capacity: usize,
    },
    /// No free checkpoint slot is left.
    #[error("checkpoint slots exhausted: all {capacity} checkpoint slots are in use")]
    CheckpointsExhausted {
        /// Number of checkpoint slots in the pool.
        capacity: usize,
    },
    /// A checkpoint image that cannot be imported.
    #[error("checkpoint refused: {0}")]
    Checkpoint(String),
    /// A device-memory operation failed.
    #[error("device memory: {0}")]
    Memory(String),
}

/// Result alias of the pool crate.
pub type Result<T, E = PoolError> = std::result::Result<T, E>;

impl PoolError {
    /// Shorthand for [`PoolError::InvalidArgument`].
    pub fn arg(arg: &'static str, msg: impl Into<String>) -> Self {
        Self::InvalidArgument {
            arg,
            msg: msg.into(),
        }
    }
}
